"""``python -m h2o_compress``: the same as the ``h2o-compress`` console script."""

from .cli import main

main()
