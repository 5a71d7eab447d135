from service.runner.job import main

raise SystemExit(main())
