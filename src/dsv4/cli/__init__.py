"""The `dsv4` command line: one module per subcommand, wired in main.py."""
