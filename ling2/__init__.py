"""Ling2: a JAX training stack for the Ling2 hybrid MLA/GLA MoE model family."""
