// The kvcanary report's script: draws the maps from their inline data, sorts and filters
// the findings tables. No external resource, no network request.
"use strict";
(function () {
  // Cell colours; the report's tests read them back from a screenshot.
  var REASON_COLOURS = {
    slot_out_of_range: "#7b3294", slot_zero_in_prefix: "#c51b7d", verify_position: "#d7301f",
    verify_token: "#f28e2b", verify_chain_hash: "#e6ab02", verify_real_kv_hash: "#1b9e77",
    write_token: "#386cb0", write_position: "#66a61e", write_slot_conflict: "#a6761d", other: "#555555"
  };
  var EMPTY = "#f4f5f6", CLEAN = "#c9dccb", BOUNDARY = "rgba(20, 30, 40, 0.55)";
  var POOL = { unused: "#f4f5f6", used: "#bccbd9", finding: "#d7301f", twice: "#f28e2b", both: "#7b3294" };
  var MAP_WIDTH = 960, REQUEST_MAP_HEIGHT = 320, POOL_CELL = 10;   // pixels: the largest pool cell
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
      var row = document.createElement("div"), swatch = document.createElement("i");
      swatch.style.background = item[1];
      row.appendChild(swatch);
      row.appendChild(document.createTextNode(item[0]));
      el.appendChild(row);
    });
  }
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

  function requestMap(canvas, m, legendEl) {
    var codes = bytes(m.codes), entries = counts(m.entries), rows = counts(m.violations);
    var requestRows = i64(m.request_rows);
    var cw = Math.max(1, Math.min(16, Math.floor(MAP_WIDTH / m.columns)));
    var ch = Math.max(2, Math.min(16, Math.floor(REQUEST_MAP_HEIGHT / m.rows)));
    canvas.width = m.columns * cw;
    canvas.height = m.rows * ch;
    canvas.dataset.cellWidth = cw;
    canvas.dataset.cellHeight = ch;
    var colours = [EMPTY, CLEAN].concat(m.reasons.map(function (r) { return REASON_COLOURS[r] || REASON_COLOURS.other; }));
    var ctx = canvas.getContext("2d");
    for (var c = 0; c < codes.length; c++) {
      ctx.fillStyle = colours[codes[c]];
      ctx.fillRect((c % m.columns) * cw, Math.floor(c / m.columns) * ch, cw, ch);
    }
    // Block boundaries, where a block is wide enough on screen to tell them apart.
    var blockPx = m.block_size ? m.block_size / m.positions_per_column * cw : 0;
    canvas.dataset.blockLines = blockPx >= 4 ? "drawn" : (m.block_size ? "too narrow" : "none");
    if (blockPx >= 4) {
      ctx.fillStyle = BOUNDARY;
      for (var x = blockPx; x < canvas.width; x += blockPx) ctx.fillRect(Math.round(x), 0, 1, canvas.height);
    }
    var items = [["nothing checked", EMPTY], ["checked, clean", CLEAN]];
    Object.keys(m.counts_by_reason).forEach(function (r) {
      items.push([r + " (" + m.counts_by_reason[r] + ")", REASON_COLOURS[r] || REASON_COLOURS.other]);
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

  function poolMap(canvas, m, legendEl) {
    var flags = bytes(m.flags), used = counts(m.used), found = counts(m.with_findings);
    var on = counts(m.rows_on), twice = counts(m.twice);
    var rows = Math.ceil(m.cells / m.columns);
    var size = Math.max(2, Math.min(POOL_CELL, Math.floor(MAP_WIDTH / m.columns)));
    canvas.width = m.columns * size;
    canvas.height = rows * size;
    canvas.dataset.cellWidth = size;
    canvas.dataset.cellHeight = size;
    var ctx = canvas.getContext("2d");
    for (var c = 0; c < m.cells; c++) {
      var f = flags[c];
      ctx.fillStyle = (f & 2) && (f & 4) ? POOL.both : f & 4 ? POOL.twice : f & 2 ? POOL.finding : f & 1 ? POOL.used : POOL.unused;
      ctx.fillRect((c % m.columns) * size, Math.floor(c / m.columns) * size, size, size);
    }
    legend(legendEl, "a cell, by any " + m.unit + " in it", [["not used by a checked entry", POOL.unused], ["used, no finding", POOL.used],
      ["with findings", POOL.finding], ["mapped twice", POOL.twice], ["both", POOL.both]]);
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
    if (requests) requestMap(requests, data.requests, document.getElementById("request-legend-" + n));
    poolMap(document.getElementById("pool-map-" + n), data.pool, document.getElementById("pool-legend-" + n));
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
