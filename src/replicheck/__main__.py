from replicheck.cli import main

raise SystemExit(main())
