// The kvcanary report's script: draws the maps from their inline data, sorts and filters
// the findings tables. No external resource, no network request.
"use strict";
(function () {
  // Fills and marks (kvcanary/report/palette.py, inline as JSON); the tests read them back
  // from a screenshot.
  var PALETTE = JSON.parse(document.getElementById("palette").textContent);
  var REQUEST = PALETTE.requests, POOL = PALETTE.pool, MIN_CELL = PALETTE.min_cell_px;
  var EMPTY = "nothing checked", CLEAN = "checked, clean", BOUNDARY = "rgba(20, 30, 40, 0.55)";
  var POOL_UNUSED = "not used by a checked entry", POOL_USED = "used, no finding";
  var POOL_FINDING = "with findings", POOL_TWICE = "mapped twice", POOL_BOTH = "both";
  var MAP_WIDTH = 960, REQUEST_MAP_HEIGHT = 320, POOL_CELL = 10;   // pixels: the largest pool cell
  var LABEL_PX = 13;   // a row label's height: thinner rows share one label
  var tip = document.getElementById("tip");

  function bytes(b64) {
    var s = atob(b64), out = new Uint8Array(s.length);
    for (var i = 0; i < s.length; i++) out[i] = s.charCodeAt(i);
    return out;
  }
  function counts(c) {   // {bytes: 1, 2 or 4, data: base64 little-endian}
    var b = bytes(c.data);
    if (c.bytes === 1) return b;
    return c.bytes === 2 ? new Uint16Array(b.buffer, 0, b.length / 2) : new Uint32Array(b.buffer, 0, b.length / 4);
  }
  function i64(b64) {
    var b = bytes(b64), v = new DataView(b.buffer), out = [];
    for (var i = 0; i < b.length; i += 8) out.push(Number(v.getBigInt64(i, true)));
    return out;
  }
  function legend(el, title, items) {
    var head = document.createElement("b");
    head.textContent = title;
    el.appendChild(head);
    items.forEach(function (item) {
      var row = document.createElement("div"), swatch = document.createElement("canvas");
      swatch.width = swatch.height = 14;
      swatch.className = "swatch";
      swatch.dataset.state = item[2];
      paint(swatch.getContext("2d"), item[1], 0, 0, 14, 14);
      row.appendChild(swatch);
      row.appendChild(document.createTextNode(item[0]));
      el.appendChild(row);
    });
  }
  // A cell: its fill, then its mark in the fill's ink (colour is never the only cue).
  function paint(ctx, state, x, y, w, h) {
    ctx.fillStyle = state.fill;
    ctx.fillRect(x, y, w, h);
    ctx.fillStyle = state.ink;
    var n = Math.min(w, h), i, mark = state.mark;
    if (mark === "slash" || mark === "cross")
      for (i = 0; i < n; i++) ctx.fillRect(x + Math.floor(i * w / n), y + h - 1 - Math.floor(i * h / n), 1, 1);
    if (mark === "backslash" || mark === "cross")
      for (i = 0; i < n; i++) ctx.fillRect(x + Math.floor(i * w / n), y + Math.floor(i * h / n), 1, 1);
    if (mark === "hbar" || mark === "plus") ctx.fillRect(x, y + Math.floor(h / 2), w, 1);
    if (mark === "vbar" || mark === "plus") ctx.fillRect(x + Math.floor(w / 2), y, 1, h);
    if (mark === "dot") {
      var d = Math.max(1, Math.floor(n / 3));
      ctx.fillRect(x + Math.floor((w - d) / 2), y + Math.floor((h - d) / 2), d, d);
    }
    if (mark === "frame") {
      ctx.fillRect(x, y, w, 1); ctx.fillRect(x, y + h - 1, w, 1);
      ctx.fillRect(x, y, 1, h); ctx.fillRect(x + w - 1, y, 1, h);
    }
  }
  // Row labels beside a map: every row is in one labelled band (one row per band where a row
  // is as tall as a label, else as few rows as make one label's height).
  function rowLabels(el, title, rows, height, name) {
    var band = Math.max(1, Math.ceil(LABEL_PX / height)), box = document.createElement("div");
    box.className = "row-labels";
    box.style.height = rows * height + "px";
    for (var r = 0; r < rows; r += band) {
      var last = Math.min(rows, r + band) - 1, label = document.createElement("div");
      label.className = "row-label";
      label.style.top = r * height + "px";
      label.style.height = (last - r + 1) * height + "px";
      label.dataset.first = r;
      label.dataset.last = last;
      label.textContent = name(r, last);
      box.appendChild(label);
    }
    el.appendChild(box);
    var head = document.createElement("div");   // under the labels, as the axis is under the map
    head.className = "row-title";
    head.textContent = title;
    el.appendChild(head);
  }
  function span(first, last) { return first === last ? String(first) : first + "\u2013" + last; }

  function hover(canvas, describe) {
    canvas.addEventListener("mousemove", function (e) {
      var r = canvas.getBoundingClientRect(), text = describe(e.clientX - r.left, e.clientY - r.top);
      if (!text) { tip.hidden = true; return; }
      tip.textContent = text;
      tip.hidden = false;
      tip.style.left = (e.clientX + 14) + "px";
      tip.style.top = (e.clientY + 14) + "px";
    });
    canvas.addEventListener("mouseleave", function () { tip.hidden = true; });
  }

  function requestMap(canvas, m, legendEl, labelsEl) {
    var codes = bytes(m.codes), entries = counts(m.entries), rows = counts(m.violations);
    var requestRows = i64(m.request_rows);
    var cw = Math.max(MIN_CELL, Math.min(16, Math.floor(MAP_WIDTH / m.columns)));
    var ch = Math.max(MIN_CELL, Math.min(16, Math.floor(REQUEST_MAP_HEIGHT / m.rows)));
    canvas.width = m.columns * cw;
    canvas.height = m.rows * ch;
    canvas.dataset.cellWidth = cw;
    canvas.dataset.cellHeight = ch;
    var states = [REQUEST[EMPTY], REQUEST[CLEAN]].concat(m.reasons.map(function (r) { return REQUEST[r] || REQUEST.other; }));
    var ctx = canvas.getContext("2d");
    for (var c = 0; c < codes.length; c++)
      paint(ctx, states[codes[c]], (c % m.columns) * cw, Math.floor(c / m.columns) * ch, cw, ch);
    rowLabels(labelsEl, m.requests_per_row === 1 ? "live request (request row)" : "live requests",
      m.rows, ch, function (first, last) {
        var r0 = first * m.requests_per_row, r1 = Math.min(m.live_requests, (last + 1) * m.requests_per_row) - 1;
        return r0 === r1 ? r0 + " (row " + requestRows[r0] + ")" : span(r0, r1);
      });
    // Block boundaries, where a block is wide enough on screen to tell them apart.
    var blockPx = m.block_size ? m.block_size / m.positions_per_column * cw : 0;
    canvas.dataset.blockLines = blockPx >= 4 ? "drawn" : (m.block_size ? "too narrow" : "none");
    if (blockPx >= 4) {
      ctx.fillStyle = BOUNDARY;
      for (var x = blockPx; x < canvas.width; x += blockPx) ctx.fillRect(Math.round(x), 0, 1, canvas.height);
    }
    var items = [[EMPTY, REQUEST[EMPTY], EMPTY], [CLEAN, REQUEST[CLEAN], CLEAN]];
    Object.keys(m.counts_by_reason).forEach(function (r) {
      items.push([r + " (" + m.counts_by_reason[r] + ")", REQUEST[r] || REQUEST.other, REQUEST[r] ? r : "other"]);
    });
    legend(legendEl, "a cell's main reason (rows)", items);
    hover(canvas, function (x, y) {
      var col = Math.floor(x / cw), row = Math.floor(y / ch);
      if (col < 0 || row < 0 || col >= m.columns || row >= m.rows) return "";
      var c = row * m.columns + col, first = row * m.requests_per_row;
      var last = Math.min(m.live_requests, first + m.requests_per_row) - 1;
      var p0 = col * m.positions_per_column, p1 = p0 + m.positions_per_column - 1;
      var who = first === last ? "live request " + first + " (request row " + requestRows[first] + ")"
        : "live requests " + first + ".." + last;
      var what = codes[c] >= 2 ? ", mostly " + m.reasons[codes[c] - 2] : "";
      return who + "\npositions " + (p0 === p1 ? p0 : p0 + ".." + p1) + "\n" + entries[c] +
        " entries checked, " + rows[c] + " violation(s)" + what;
    });
  }

  function poolMap(canvas, m, legendEl, labelsEl) {
    var flags = bytes(m.flags), used = counts(m.used), found = counts(m.with_findings);
    var on = counts(m.rows_on), twice = counts(m.twice);
    var rows = Math.ceil(m.cells / m.columns);
    var size = Math.max(MIN_CELL, Math.min(POOL_CELL, Math.floor(MAP_WIDTH / m.columns)));
    canvas.width = m.columns * size;
    canvas.height = rows * size;
    canvas.dataset.cellWidth = size;
    canvas.dataset.cellHeight = size;
    var ctx = canvas.getContext("2d");
    for (var c = 0; c < m.cells; c++) {
      var f = flags[c];
      var state = (f & 2) && (f & 4) ? POOL_BOTH : f & 4 ? POOL_TWICE : f & 2 ? POOL_FINDING : f & 1 ? POOL_USED : POOL_UNUSED;
      paint(ctx, POOL[state], (c % m.columns) * size, Math.floor(c / m.columns) * size, size, size);
    }
    var perRow = m.columns * m.per_cell;
    rowLabels(labelsEl, m.unit + "s", rows, size, function (first, last) {
      return span(first * perRow, Math.min(m.units, (last + 1) * perRow) - 1);
    });
    legend(legendEl, "a cell, by any " + m.unit + " in it", [POOL_UNUSED, POOL_USED, POOL_FINDING, POOL_TWICE, POOL_BOTH].map(
      function (name) { return [name, POOL[name], name]; }));
    hover(canvas, function (x, y) {
      var c = Math.floor(y / size) * m.columns + Math.floor(x / size);
      if (x < 0 || y < 0 || x >= canvas.width || c >= m.cells) return "";
      var u0 = c * m.per_cell, u1 = Math.min(m.units, u0 + m.per_cell) - 1;
      var name = m.unit + (u0 === u1 ? " " + u0 : "s " + u0 + ".." + u1);
      return name + "\n" + used[c] + " used, " + found[c] + " with findings (" + on[c] +
        " row(s)), " + twice[c] + " mapped twice";
    });
  }

  Array.prototype.forEach.call(document.querySelectorAll("script.map-data"), function (el) {
    var data = JSON.parse(el.textContent), n = el.dataset.section;
    var requests = document.getElementById("request-map-" + n);   // absent: no live request
    if (requests) requestMap(requests, data.requests, document.getElementById("request-legend-" + n),
                             document.getElementById("request-rows-" + n));
    poolMap(document.getElementById("pool-map-" + n), data.pool, document.getElementById("pool-legend-" + n),
            document.getElementById("pool-rows-" + n));
  });

  // Findings tables: click a heading to sort (numbers as numbers), filter by text, reason, tag.
  Array.prototype.forEach.call(document.querySelectorAll("table.findings"), function (table) {
    var body = table.tBodies[0], section = table.closest("section");
    var heads = table.tHead.rows[0].cells;
    Array.prototype.forEach.call(heads, function (th, col) {
      th.addEventListener("click", function () {
        var ascending = th.getAttribute("aria-sort") !== "ascending";
        Array.prototype.forEach.call(heads, function (h) { h.removeAttribute("aria-sort"); });
        th.setAttribute("aria-sort", ascending ? "ascending" : "descending");
        var rows = Array.prototype.slice.call(body.rows);
        var numeric = th.dataset.type === "num";
        var keyed = rows.map(function (r, i) {
          var text = r.cells[col].textContent;
          return { row: r, i: i, text: text, value: numeric && text !== "" ? Number(text) : NaN };
        });
        keyed.sort(function (a, b) {   // empty cells last either way; ties keep their order
          var d;
          if (numeric && isNaN(a.value) !== isNaN(b.value)) return isNaN(a.value) ? 1 : -1;
          d = numeric && !isNaN(a.value) ? a.value - b.value : a.text.localeCompare(b.text);
          return (ascending ? d : -d) || a.i - b.i;
        });
        rows = keyed.map(function (k) { return k.row; });
        rows.forEach(function (r) { body.appendChild(r); });
      });
    });
    var text = section.querySelector(".filter-text"), reason = section.querySelector(".filter-reason");
    var tag = section.querySelector(".filter-tag"), shown = section.querySelector(".shown");
    function apply() {
      var needle = text.value.trim().toLowerCase(), count = 0;
      Array.prototype.forEach.call(body.rows, function (r) {
        var ok = (!needle || r.textContent.toLowerCase().indexOf(needle) >= 0) &&
          (!reason.value || (" " + r.dataset.reasons + " ").indexOf(" " + reason.value + " ") >= 0) &&
          (!tag || !tag.value || r.dataset.tag === tag.value);
        r.hidden = !ok;
        if (ok) count++;
      });
      shown.textContent = count + " of " + body.rows.length + " shown";
    }
    [text, reason, tag].forEach(function (el) { if (el) el.addEventListener("input", apply); });
    apply();
  });
})();
