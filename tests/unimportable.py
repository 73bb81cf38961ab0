"""A module of an installed app that fails to import: a job naming a Task in it must not crash
the worker."""

raise RuntimeError("this module cannot be imported")
