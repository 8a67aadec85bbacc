"""`python -m scheduler.cli`: the `blockmgr` command."""

from scheduler.cli.main import main

raise SystemExit(main())
