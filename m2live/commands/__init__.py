"""Subcommands of the ``m2live`` CLI: each module has ``add_arguments(parser)`` and ``run(args) -> int``."""
