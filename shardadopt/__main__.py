from shardadopt.cli import entry

entry()
