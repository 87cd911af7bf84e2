"""``python -m h2o_compress``: the same as the ``h2o-compress`` console script."""

from h2o_compress.cli import main

main()
