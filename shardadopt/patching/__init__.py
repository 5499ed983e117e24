"""The patch machinery: what a patch declares (``contract.Patch``), the registry that applies patches lazily and
reversibly, the order their wrappers stack in on a shared target (``stacking``), the states a patch can be in, and
the refusal of a model that needs a patch which could not apply.

The patches themselves are in ``shardadopt.patches``, one module each; docs/design.md describes the lifecycle.
"""
