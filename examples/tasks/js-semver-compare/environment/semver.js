"use strict";

function compare(a, b) {
  if (a === b) return 0;
  return a < b ? -1 : 1;
}

function sortVersions(list) {
  return list.sort(compare);
}

module.exports = { compare, sortVersions };
