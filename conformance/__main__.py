from aiak.conformance.cli import main

raise SystemExit(main())
