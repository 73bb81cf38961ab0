"""The runtime: the worker loop, running handlers, and the chores every worker shares."""
