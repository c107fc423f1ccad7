"""A clock the test moves by hand (``clock.now += 5``), for time-based logic."""


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now
