from pricer import ending

ending.exit_1_on_signals()    # first: a signal during the imports below ends the command with 1

from pricer.cli import main

raise SystemExit(main())
