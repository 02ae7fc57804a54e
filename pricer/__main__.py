from pricer.cli import main

raise SystemExit(main())
