from kiln.passes import fuse_gemm, merge_parallel_gemms

from .util import check_pass, helper, model, ops, rand


def test_q_k_v_projections_merge_into_one_gemm_and_split():
    nodes, inits = [], {}
    for i, name in enumerate("qkv"):
        nodes += [helper.make_node("MatMul", ["x", f"w{name}"], [f"m{name}"]),
                  helper.make_node("Add", [f"m{name}", f"b{name}"], [name]),
                  helper.make_node("Neg", [name], [f"{name}_out"])]  # each read right after it is made
        inits[f"w{name}"], inits[f"b{name}"] = rand(8, 6, seed=i), rand(6, seed=10 + i)
    m = model(nodes, [("x", [2, 5, 8])], [(f"{n}_out", [2, 5, 6]) for n in "qkv"], inits)

    class Both:
        @staticmethod
        def run(g):
            fuse_gemm.run(g)
            merge_parallel_gemms.run(g)

    _, after = check_pass(Both, m, {"x": rand(2, 5, 8, seed=3)}, atol=1e-4)
    assert ops(after) == ["kiln::FusedGemm", "Split", "Neg", "Neg", "Neg"]
    assert tuple(after.initializers[after.nodes[0].inputs[1]].shape) == (8, 18)
