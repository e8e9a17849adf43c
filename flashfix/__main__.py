from flashfix._cli import main

raise SystemExit(main())
