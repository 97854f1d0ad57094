"""A data iterator for checkpoint tests. Test-only."""


class Counter:
    """A data iterator whose state is the number of batches taken (bytes, like the trainer's)."""

    def __init__(self):
        self.n = 0

    def __next__(self):
        self.n += 1
        return self.n

    def get_state(self):
        return str(self.n).encode()

    def set_state(self, state):
        self.n = int(state)

    def start_prefetch(self):
        pass
