"""XLA's planned device memory for a compiled program, as the benchmarks report it."""


def planned_bytes(mem) -> int:
    """Arguments + outputs + temporaries - aliased (donated) bytes of `compiled.memory_analysis()`."""
    return int(mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
               - mem.alias_size_in_bytes)
