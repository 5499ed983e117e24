"""What the ``shardadopt`` command runs beside the self-test (``shardadopt.selftest``): ``doctor --model``'s
architecture coverage.
"""
