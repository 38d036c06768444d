"""zfunc's version: ``zf.__version__``, and what each checkpoint's manifest records as its writer."""
__version__ = "0.1.0"
