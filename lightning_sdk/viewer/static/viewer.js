// The run viewer's one script: a tooltip with a token's id, mask, log-prob, advantage and policy version.
(function () {
  const tip = document.getElementById("tip");
  document.addEventListener("mouseover", function (ev) {
    const t = ev.target.closest ? ev.target.closest(".tok") : null;
    if (!t) { tip.hidden = true; return; }
    const d = t.dataset;
    tip.textContent = "id " + d.id + " · " + (t.classList.contains("m1") ? "trained" : "context") +
      " · logprob " + d.lp + " · advantage " + d.adv + " · version " + (d.v === "" ? "-" : d.v);
    tip.hidden = false;
  });
  document.addEventListener("mousemove", function (ev) {
    if (!tip.hidden) { tip.style.left = (ev.clientX + 12) + "px"; tip.style.top = (ev.clientY + 14) + "px"; }
  });
})();
