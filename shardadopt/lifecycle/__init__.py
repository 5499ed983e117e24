"""The life of a job's process groups: key space per torchrun attempt (``restarts``), caches bound to one world
(``worldbound``) and releasing the groups at a clean exit (``cleanexit``).
"""
