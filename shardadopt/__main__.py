from shardadopt.cli import _entry

_entry()
