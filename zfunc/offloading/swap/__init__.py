"""Swap: tensors kept in files on NVMe. engine.py is the async I/O engine; directory.py its folder, lock and
raw file operations; file_format.py the header, aligned memory and checksums; transfer.py one file's
transfer cut into blocks.
"""
