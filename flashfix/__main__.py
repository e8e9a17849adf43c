from flashfix.tools.cli import main

raise SystemExit(main())
