from cnn.cli import main

raise SystemExit(main())
