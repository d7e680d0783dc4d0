"""`python -m respo_jax.symbolic [-v]`: prove every claim; exit status 1 if any fails."""

from respo_jax.symbolic.verify import main

raise SystemExit(main())
