// deferral status page: live refresh, written for this project (no library, no build step).
// Every few seconds the page is fetched again and each element marked data-live (with an id)
// is replaced by its fresh copy. Without JavaScript the page is a plain page: reload it.
(function () {
  "use strict";
  var status = document.getElementById("live-status");
  var interval = Number((status && status.dataset.intervalMs) || 2000);
  var busy = false;

  function stamp(text) {
    if (status) { status.textContent = text; }
  }

  function refresh() {
    if (busy || document.hidden) { return; }
    busy = true;
    fetch(window.location.href, { headers: { "X-Deferral-Live": "1" }, cache: "no-store" })
      .then(function (response) {
        if (!response.ok) { throw new Error("HTTP " + response.status); }
        return response.text();
      })
      .then(function (html) {
        var fresh = new DOMParser().parseFromString(html, "text/html");
        document.querySelectorAll("[data-live][id]").forEach(function (region) {
          var next = fresh.getElementById(region.id);
          if (next && next.innerHTML !== region.innerHTML) { region.innerHTML = next.innerHTML; }
        });
        stamp("live · updated " + new Date().toLocaleTimeString());
        document.body.dataset.refreshes = String(Number(document.body.dataset.refreshes || 0) + 1);
      })
      .catch(function (error) { stamp("live · refresh failed (" + error.message + "), retrying"); })
      .then(function () { busy = false; });
  }

  if (document.querySelector("[data-live]")) {
    stamp("live");
    window.setInterval(refresh, interval);
  }
})();
