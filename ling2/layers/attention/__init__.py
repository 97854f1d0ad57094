"""The attention kinds of the hybrid (MLA, GLA, KDA): one module per kind, the registry that names them
(`registry.ATTENTION`), and the cached-decoding bookkeeping they share (`decode`)."""
