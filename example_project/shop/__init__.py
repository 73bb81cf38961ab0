"""The example shop: orders, and the jobs that follow them."""
