"use strict";
const assert = require("assert");
const { compare, sortVersions } = require("/app/semver.js");

let failures = 0;
function test(name, fn) {
  try { fn(); console.log("ok", name); } catch (e) { failures++; console.log("FAIL", name, e.message); }
}
const sign = (x) => Math.sign(x);

test("numeric fields", () => {
  assert.strictEqual(sign(compare("1.10.0", "1.9.0")), 1);
  assert.strictEqual(sign(compare("2.0.0", "10.0.0")), -1);
  assert.strictEqual(compare("1.2.3", "1.2.3"), 0);
});
test("prerelease below release", () => assert.strictEqual(sign(compare("1.0.0-rc.1", "1.0.0")), -1));
test("build metadata ignored", () => assert.strictEqual(compare("1.0.0+build.5", "1.0.0+other"), 0));
test("spec ordering", () => {
  const order = ["1.0.0-alpha", "1.0.0-alpha.1", "1.0.0-alpha.beta", "1.0.0-beta", "1.0.0-beta.2",
                 "1.0.0-beta.11", "1.0.0-rc.1", "1.0.0", "1.0.1", "1.1.0", "1.10.0"];
  const shuffled = [order[5], order[0], order[10], order[3], order[7], order[1], order[9], order[2], order[8],
                    order[6], order[4]];
  const copy = shuffled.slice();
  assert.deepStrictEqual(sortVersions(shuffled), order);
  assert.deepStrictEqual(shuffled, copy, "input must not be modified");
});
test("invalid versions throw", () => {
  for (const bad of ["1.0", "a.b.c", "1.0.0-", "01.0.0x", ""]) {
    assert.throws(() => compare(bad, "1.0.0"), TypeError, bad);
  }
});
process.exit(failures ? 1 : 0);
