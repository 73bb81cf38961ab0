// Live refresh: while its toggle is on (remembered in this browser), the page's #pgjobs-live
// part is loaded again every data-seconds seconds, as Sidekiq's "live poll" does.
(function () {
  "use strict";
  var toggle = document.getElementById("pgjobs-live-toggle");
  if (!toggle) return;
  var said = document.getElementById("pgjobs-live-status");
  var seconds = Number(toggle.dataset.seconds) || 5;
  var timer = null;

  function refresh() {
    fetch(window.location.href, { credentials: "same-origin" })
      .then(function (response) {
        if (!response.ok) throw new Error("HTTP " + response.status);
        return response.text();
      })
      .then(function (text) {
        var page = new DOMParser().parseFromString(text, "text/html");
        var fresh = page.getElementById("pgjobs-live");
        var shown = document.getElementById("pgjobs-live");
        if (!fresh || !shown) throw new Error("the page changed");
        shown.replaceWith(fresh);
        said.textContent = toggle.dataset.updated + " " + new Date().toLocaleTimeString();
      })
      .catch(function (error) {
        said.textContent = toggle.dataset.failed + " " + error.message;
      });
  }

  function set() {
    window.localStorage.setItem("pgjobs-live", toggle.checked ? "on" : "off");
    window.clearInterval(timer);
    timer = toggle.checked ? window.setInterval(refresh, seconds * 1000) : null;
    if (!toggle.checked) said.textContent = "";
  }

  toggle.checked = window.localStorage.getItem("pgjobs-live") === "on";
  toggle.addEventListener("change", set);
  set();
})();
