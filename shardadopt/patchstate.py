"""The states a patch can be in (``shardadopt.status()`` reports one per patch), named once for every layer.

The registry sets them; ``shardadopt.versions`` reads them to tell a user what could not apply without depending on
the patch machinery (the registry sits above it).
"""

APPLIED = "applied"
NOT_NEEDED = "not-needed"
UNSUPPORTED = "unsupported"
OFF = "off"
PENDING = "pending"  # enabled, waiting for its upstream modules to be imported
