"use strict";
const assert = require("assert");
const { deepMerge } = require("/app/merge.js");

let failures = 0;
function test(name, fn) {
  try { fn(); console.log("ok", name); } catch (e) { failures++; console.log("FAIL", name, e.message); }
}

test("flat", () => assert.deepStrictEqual(deepMerge({ a: 1, b: 2 }, { b: 3, c: 4 }), { a: 1, b: 3, c: 4 }));
test("nested", () => assert.deepStrictEqual(
  deepMerge({ a: { x: 1, y: { z: 1 } } }, { a: { y: { w: 2 } } }), { a: { x: 1, y: { z: 1, w: 2 } } }));
test("arrays replaced", () => assert.deepStrictEqual(deepMerge({ a: [1, 2] }, { a: [3] }), { a: [3] }));
test("null overrides", () => assert.deepStrictEqual(deepMerge({ a: { x: 1 } }, { a: null }), { a: null }));
test("object replaces scalar", () => assert.deepStrictEqual(deepMerge({ a: 1 }, { a: { b: 2 } }), { a: { b: 2 } }));
test("no mutation and no sharing", () => {
  const t = { a: { x: 1 }, l: [1] }, s = { b: { y: 2 }, m: [2] };
  const r = deepMerge(t, s);
  assert.deepStrictEqual(t, { a: { x: 1 }, l: [1] });
  assert.deepStrictEqual(s, { b: { y: 2 }, m: [2] });
  r.a.x = 99; r.b.y = 99; r.l.push(5); r.m.push(5);
  assert.strictEqual(t.a.x, 1); assert.strictEqual(s.b.y, 2);
  assert.deepStrictEqual(t.l, [1]); assert.deepStrictEqual(s.m, [2]);
});
test("prototype pollution ignored", () => {
  const r = deepMerge({}, JSON.parse('{"__proto__": {"polluted": true}, "ok": 1}'));
  assert.strictEqual(({}).polluted, undefined);
  assert.strictEqual(r.polluted, undefined);
  assert.strictEqual(r.ok, 1);
});
process.exit(failures ? 1 : 0);
