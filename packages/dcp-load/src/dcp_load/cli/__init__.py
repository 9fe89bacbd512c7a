"""The `dcp` command: argument parsing and the inspect, verify, plan and convert subcommands. The top layer."""

__all__: list[str] = []
