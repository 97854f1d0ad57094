"""The MoE layer's kernels: the grouped matmul over rows sorted by expert with its backends (`gmm`; Ling2's
Pallas Triton kernel for CUDA in `pallas_gpu`) and the ragged all-to-all with its VJP (`a2a`)."""
