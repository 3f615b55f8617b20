import json
import os
import subprocess
import tempfile
import unittest


def run_report(args, cwd):
    subprocess.run(["python3", "/app/report.py", *args], cwd=cwd, check=True, timeout=30)


class ReportTest(unittest.TestCase):
    def test_default_paths(self):
        run_report([], "/app")
        with open("/app/report.json") as f:
            got = json.load(f)
        self.assertEqual(got["rows"], 5)
        self.assertAlmostEqual(got["total_revenue"], 83.75)
        self.assertEqual(got["by_region"], {"east": 35.0, "west": 30.0, "north": 18.75})
        self.assertEqual(got["top_product"], "widget")

    def test_other_file_and_ties(self):
        with tempfile.TemporaryDirectory() as d:
            src = os.path.join(d, "in.csv")
            with open(src, "w") as f:
                f.write("date,region,product,units,unit_price\n"
                        "2024-02-01,south,bolt,5,0.10\n"
                        "2024-02-01,south,axle,5,3.334\n"
                        "2024-02-02,east,bolt,x,1\n")
            out = os.path.join(d, "out.json")
            run_report([src, out], d)
            with open(out) as f:
                got = json.load(f)
        self.assertEqual(got["rows"], 2)
        self.assertAlmostEqual(got["total_revenue"], 17.17)
        self.assertEqual(got["by_region"], {"south": 17.17})
        self.assertEqual(got["top_product"], "axle")


if __name__ == "__main__":
    unittest.main()
