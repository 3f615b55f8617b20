import random
import sys
import unittest

sys.path.append("/app")  # after the standard library: the work tree cannot shadow it

from intervals import merge


class MergeTest(unittest.TestCase):
    def test_examples(self):
        self.assertEqual(merge([]), [])
        self.assertEqual(merge([(1, 3), (3, 5)]), [(1, 5)])
        self.assertEqual(merge([(1, 2), (3, 4)]), [(1, 2), (3, 4)])
        self.assertEqual(merge([(5, 8), (1, 3), (2, 4)]), [(1, 4), (5, 8)])
        self.assertEqual(merge([(1, 10), (2, 3)]), [(1, 10)])
        self.assertEqual(merge([(4, 4)]), [(4, 4)])

    def test_does_not_modify_input(self):
        data = [(3, 4), (1, 2)]
        merge(data)
        self.assertEqual(data, [(3, 4), (1, 2)])

    def test_invalid(self):
        with self.assertRaises(ValueError):
            merge([(2, 1)])

    def test_random_against_sets(self):
        rng = random.Random(0)
        for _ in range(300):
            data = []
            for _ in range(rng.randint(1, 6)):
                s = rng.randint(0, 30)
                data.append((s, s + rng.randint(0, 5)))
            got = merge(data)
            covered = {x for s, e in data for x in range(s, e + 1)}
            self.assertEqual({x for s, e in got for x in range(s, e + 1)}, covered)
            for (s1, e1), (s2, e2) in zip(got, got[1:]):
                self.assertLess(e1, s2)
            for s, e in got:
                self.assertLessEqual(s, e)


if __name__ == "__main__":
    unittest.main()
