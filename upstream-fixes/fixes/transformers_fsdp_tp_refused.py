"""transformers-fsdp-tp-refused: 5.16 / 5.17 accept DistributedConfig(fsdp_size=N, tp_size=M) but apply TP alone."""

from upstream_diffs import LICENSE_HEADER, Edit, Fix, NewFile

TEST = LICENSE_HEADER + '''\
import unittest

from transformers.distributed import DistributedConfig


class DistributedConfigSupportedLayoutsTest(unittest.TestCase):
    def test_fsdp_with_tp_is_refused(self):
        # `maybe_distribute_model` applies one kind of sharding: TP alone on a `tp_size`-rank mesh, so the ranks
        # outside it would fail while the others wait in collectives. Every rank must refuse the config instead.
        for sizes in ({"fsdp_size": 2, "tp_size": 2}, {"fsdp_size": 2, "tp_size": 2, "pp_size": 2}):
            with self.subTest(**sizes):
                with self.assertRaisesRegex(ValueError, "FSDP\\\\+TP"):
                    DistributedConfig(**sizes)
                with self.assertRaisesRegex(ValueError, "FSDP\\\\+TP"):
                    DistributedConfig.from_dict(sizes)

    def test_one_dimensional_layouts_are_accepted(self):
        for sizes in ({"fsdp_size": 4}, {"tp_size": 4}, {"pp_size": 4}, {"fsdp_size": 1, "tp_size": 4}):
            with self.subTest(**sizes):
                config = DistributedConfig(**sizes)
                self.assertEqual(config.fsdp_size * config.tp_size * config.pp_size, 4)
'''

FIX = Fix(
    id="transformers-fsdp-tp-refused",
    distribution="transformers",
    kind="proposal",
    upstream=("a transformers 5.17.x patch release (restores 5.15's check; main made the combination work in 5.18 "
              "with 2-D loading, too large a change to backport)"),
    summary="""
        5.16 narrowed DistributedConfig's "FSDP+TP is not supported yet" check to FSDP+TP+PP, but
        prepare_distribute_model and maybe_distribute_model still apply one kind of sharding ("if tp_size > 1: ...
        elif fsdp_size > 1: ..."). DistributedConfig(fsdp_size=2, tp_size=2) on 4 ranks therefore builds a 2-rank TP
        mesh and never applies FSDP: ranks 2-3 fail with IndexError in DeviceMesh.get_group while ranks 0-1 wait in
        collectives.

        Refuse FSDP with TP again in DistributedConfig.__post_init__, as 5.15 did, so every rank raises the same
        ValueError before any process group or mesh exists.

        Not a backport: 5.18 fixed the cause by applying TP and then FSDP on one 2-D mesh (initialize_distributed_mesh,
        the new maybe_distribute_model, FSDP-first state-dict gathering, and the DistributedConfig rules around them).
        That is a new feature spread over the loading and saving paths, not something to carry onto a patch release;
        the refusal is the patch-release fix, and users who need 2-D loading upgrade to 5.18.
    """,
    edits=(
        Edit(
            "src/transformers/distributed/configuration_utils.py",
            '        if self.tp_size > 1 and self.fsdp_size > 1 and self.pp_size > 1:\n'
            '            raise ValueError(\n'
            '                "FSDP+TP+PP is not supported yet. "\n'
            '                "Use DistributedConfig(fsdp_size=N) or DistributedConfig(tp_size=N) or DistributedConfig(pp_size=N), not all three. "\n'
            '                "Only 1D support is available for now."\n'
            '            )\n',
            '        # `maybe_distribute_model` applies one kind of sharding: with both, TP alone would run on a\n'
            '        # `tp_size`-rank mesh and the ranks outside it would fail.\n'
            '        if self.tp_size > 1 and self.fsdp_size > 1:\n'
            '            raise ValueError(\n'
            '                "FSDP+TP is not supported yet. "\n'
            '                "Use DistributedConfig(fsdp_size=N) or DistributedConfig(tp_size=N), not both. "\n'
            '                "Only 1D support is available for now."\n'
            '            )\n',
        ),
    ),
    new_files=(NewFile("tests/distributed/test_distributed_config.py", TEST),),
)
