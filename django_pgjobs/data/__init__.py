"""The data layer: the statements that change jobs and queues, and the managers that run them."""
