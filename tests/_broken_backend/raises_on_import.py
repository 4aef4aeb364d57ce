ZERO = 1 / 0
