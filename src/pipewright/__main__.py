from pipewright.cli import main

raise SystemExit(main())
