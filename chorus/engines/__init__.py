"""Where tokens come from: the Engine protocol, the transformers engine, the fake engine, sampling.

Importing this package imports neither transformers nor any GPU code; engines load lazily.
"""
