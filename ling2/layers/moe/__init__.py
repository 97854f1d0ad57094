"""The Mixture-of-Experts layer: sigmoid group routing with loss-free balancing (`router`), the dropless
experts and their dispatch (`experts`), expert parallelism over the mesh (`ep`), and the layer (`layer`)."""
