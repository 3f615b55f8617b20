import sys
import unittest

sys.path.append("/app")  # after the standard library: the work tree cannot shadow it

from roman import from_roman, to_roman


class RomanTest(unittest.TestCase):
    def test_known_values(self):
        for n, s in [(1, "I"), (4, "IV"), (9, "IX"), (14, "XIV"), (40, "XL"), (90, "XC"), (400, "CD"),
                     (1994, "MCMXCIV"), (2024, "MMXXIV"), (3999, "MMMCMXCIX")]:
            self.assertEqual(to_roman(n), s)
            self.assertEqual(from_roman(s), n)

    def test_round_trip(self):
        for n in range(1, 4000):
            self.assertEqual(from_roman(to_roman(n)), n)

    def test_out_of_range(self):
        for bad in (0, -1, 4000, 2.5, "10"):
            with self.assertRaises(ValueError):
                to_roman(bad)

    def test_invalid_numerals(self):
        for bad in ("", "IIII", "IC", "MMMM", "VV", "iv", "XIIV", "ABC", "IL"):
            with self.assertRaises(ValueError, msg=bad):
                from_roman(bad)


if __name__ == "__main__":
    unittest.main()
