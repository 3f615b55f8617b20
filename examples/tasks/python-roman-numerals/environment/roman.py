"""Conversion between integers and Roman numerals."""


def to_roman(n: int) -> str:
    """Canonical Roman numeral of 1 <= n <= 3999; ValueError otherwise."""
    raise NotImplementedError


def from_roman(s: str) -> int:
    """Value of a canonical Roman numeral; ValueError for anything else."""
    raise NotImplementedError
