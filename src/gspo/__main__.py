from gspo.cli import main

raise SystemExit(main())
