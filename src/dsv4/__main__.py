"""`python -m dsv4` is the `dsv4` command line."""

from dsv4.cli.main import main

raise SystemExit(main())
