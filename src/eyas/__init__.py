"""eyas: train, convert, verify and run EAGLE-3 speculative-decoding drafters."""

__version__ = "0.1.0"
