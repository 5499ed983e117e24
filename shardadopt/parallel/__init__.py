"""The parallelism mechanisms an adopted model trains with: its topology (which mesh dimension does what), tensor and
expert parallelism, FSDP units, optimizer groups per mesh, sampling agreement across TP ranks, ring attention on CPU.

Plain functions on models, meshes and gradients; they know nothing about patching (``shardadopt.patching``) and
nothing above them imports back down through them.
"""
