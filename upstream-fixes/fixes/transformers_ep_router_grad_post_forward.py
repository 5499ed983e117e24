"""transformers-ep-router-grad-post-forward: sum the expert-parallel router's score gradient over the EP group
before the non-local mask (transformers 5.16 layout: ``EpRouterParallel.transform_output_post_forward``)."""

from pathlib import Path

from upstream_diffs import Edit, Fix, load_fix

# the same test as the 5.15 layout's fix
ROUTER_GRAD = load_fix(Path(__file__).with_name("transformers_ep_router_grad.py"))

FIX = Fix(
    id="transformers-ep-router-grad-post-forward",
    distribution="transformers",
    kind="backport",
    upstream="huggingface/transformers#48205, released in 5.17.0",
    summary="""
        Under expert parallelism EpRouterParallel.transform_output_post_forward zeroes the routing scores of the
        experts a rank does not own. In backward each rank's score gradient therefore covers only its own experts'
        slots, and nothing adds the other ranks' slots: the router and every layer before an MoE block get partial
        gradients that differ between ranks.

        Sum the score gradient over the EP group before the mask (each slot has exactly one owning rank, so the sum
        is exact), only while autograd records: the change 5.17.0 made, line for line. The test runs one backward
        of a two-layer Qwen3-MoE over 2 expert-parallel ranks (gloo, CPU) and compares every gradient with one
        process on the same batch; its experts run a plain loop over the local experts (registered in
        ExpertsInterface), so the test checks the router alone.
    """,
    edits=(
        Edit("src/transformers/distributed/tensor_parallel.py",
             "        router_logits, router_scores, router_indices, *extra_outputs = output\n",
             "        router_logits, router_scores, router_indices, *extra_outputs = output\n"
             "        # Each rank's score gradient covers only its local experts' slots; sum the per-rank partials\n"
             "        # before the mask (each slot has exactly one owning rank, so the sum is exact).\n"
             "        if torch.is_grad_enabled() and router_scores.requires_grad:\n"
             "            process_group = mesh.get_group() if mesh.ndim == 1 else mesh.get_group(\"tp\")\n"
             "            router_scores = _AllReduceBackward.apply(router_scores, process_group)\n"),
    ),
    new_files=ROUTER_GRAD.new_files,
)
