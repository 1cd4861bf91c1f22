"""Pixels of a synthetic mammogram: breast and muscle masks, tissue, lesions, burned-in text.

Tissue and lesions are drawn in the left-laterality frame (chest wall at x = 0, nipple pointing
right), float32 intensities in [0, 1]; ``render_view`` then mirrors right breasts (chest wall on
the right edge, as in the originals) and burns in the text label. write.py turns the result into
stored DICOM values. The only randomness is the ``rng`` passed in, drawn in a fixed order.
"""
import cv2
import numpy as np


def _smooth_noise(rng, shape, sigma):
    """Gaussian-filtered white noise, normalised to zero mean / unit std."""
    n = rng.standard_normal(shape).astype(np.float32)
    n = cv2.GaussianBlur(n, (0, 0), sigmaX=max(sigma, 0.3))
    return (n - n.mean()) / (n.std() + 1e-6)


def power_law_noise(rng, shape, beta):
    """Zero-mean, unit-std noise whose power spectrum falls as 1/f^beta: the anatomical
    background of mammograms (beta ~ 3, Burgess et al. 2001), unlike white or Gaussian-blurred
    noise, which has no structure at every scale. Periodic (FFT synthesis)."""
    rows, cols = shape
    fy = np.fft.fftfreq(rows)[:, None]
    fx = np.fft.rfftfreq(cols)[None, :]
    f = np.sqrt(fx * fx + fy * fy)
    f[0, 0] = 1.0
    amp = f ** (-beta / 2.0)
    amp[0, 0] = 0.0
    spec = (rng.standard_normal(amp.shape) + 1j * rng.standard_normal(amp.shape)) * amp
    n = np.fft.irfft2(spec, s=(rows, cols)).astype(np.float32)
    return (n - n.mean()) / (n.std() + 1e-6)


def _vessel_path(rng, geo, view, rows, cols):
    """Points of one sinuous vessel (left frame): from the chest wall side towards the nipple,
    a smooth random walk in direction."""
    cy = geo["cc_cy"] if view == "CC" else geo["mlo_cy"]
    b = geo["cc_b"] if view == "CC" else geo["mlo_b"]
    x, y = float(rng.uniform(0.0, 0.3) * geo["a"]), float(cy + rng.uniform(-0.8, 0.8) * b)
    ang = float(np.arctan2(cy - y, geo["a"] - x) + rng.normal(0, 0.35))
    step, pts = max(1.0, 0.02 * cols), []
    for _ in range(int(rng.integers(25, 60))):
        pts.append((x, y))
        ang += float(rng.normal(0, 0.12))
        x, y = x + step * np.cos(ang), y + step * np.sin(ang)
    return np.asarray(pts)


def render_vessels(rng, img, breast, geo, view, n, calc_fraction, cols):
    """Adds ``n`` crossing vessels (faint tubes) in place; a ``calc_fraction`` of them carry
    vascular calcifications (paired "tram-track" dots along a stretch): benign look-alikes of
    linear calcifications and of mass edges. Returns the vessels' own density (for tests)."""
    rows = img.shape[0]
    dens = np.zeros(img.shape, np.float32)
    for _ in range(n):
        pts = _vessel_path(rng, geo, view, rows, cols)
        width = max(1, int(round(rng.uniform(0.008, 0.018) * cols)))
        tube = np.zeros(img.shape, np.float32)
        cv2.polylines(tube, [np.round(pts * 16).astype(np.int32)], False, 1.0, width,
                      cv2.LINE_AA, shift=4)
        tube = cv2.GaussianBlur(tube, (0, 0), max(0.5, 0.4 * width))
        dens += tube * float(rng.uniform(0.03, 0.07))
        if rng.uniform() < calc_fraction:  # tram-track calcification along a stretch
            k0 = int(rng.integers(0, max(1, len(pts) - 12)))
            for k in range(k0, min(len(pts) - 1, k0 + int(rng.integers(5, 12)))):
                (x0, y0), (x1, y1) = pts[k], pts[k + 1]
                nx, ny = -(y1 - y0), x1 - x0
                nn = np.hypot(nx, ny) + 1e-6
                for side in (-1, 1):
                    if rng.uniform() < 0.4:  # broken tracks, as in the films
                        continue
                    cx, cyy = x0 + side * 0.5 * width * nx / nn, y0 + side * 0.5 * width * ny / nn
                    cv2.circle(dens, (int(round(cx * 16)), int(round(cyy * 16))),
                               int(round(max(0.6, 0.004 * cols) * 16)),
                               float(rng.uniform(0.08, 0.2)), -1, cv2.LINE_AA, shift=4)
    dens *= breast
    img += dens
    return dens


def breast_masks(geo, view, rows, cols):
    """Breast and pectoral masks in the left-laterality frame (chest wall at x = 0)."""
    yy, xx = np.mgrid[0:rows, 0:cols].astype(np.float32)
    b, cy = (geo["cc_b"], geo["cc_cy"]) if view == "CC" else (geo["mlo_b"], geo["mlo_cy"])
    breast = (xx / geo["a"]) ** 2 + ((yy - cy) / b) ** 2 <= 1.0
    pect = np.zeros_like(breast)
    if view == "MLO":
        pect = (xx / geo["pect_w"] + yy / geo["pect_h"]) <= 1.0
        breast |= pect
    return breast, pect


def lesion_room(breast, pect):
    """Distance to the nearest pixel outside (breast minus a slightly dilated muscle): how large
    a lesion centred there may be (plan.place_lesions)."""
    free = breast & ~cv2.dilate(pect.astype(np.uint8), np.ones((3, 3), np.uint8)).astype(bool)
    return cv2.distanceTransform(free.astype(np.uint8), cv2.DIST_L2, 3)


def _radial_strands(rng, nipple, shape, cols):
    """Fibrous strands converging on the nipple: noise smeared along rays, mapped to the image."""
    rows = shape[0]
    n_t, n_r = 360, int(np.hypot(rows, cols)) + 2
    polar = rng.standard_normal((n_t, n_r)).astype(np.float32)
    polar = cv2.blur(polar, (max(3, int(0.15 * cols) | 1), 1))  # along the ray (radius axis)
    polar = cv2.GaussianBlur(polar, (0, 0), sigmaX=0.5, sigmaY=0.8)
    yy, xx = np.mgrid[0:rows, 0:cols].astype(np.float32)
    dx, dy = xx - nipple[0], yy - nipple[1]
    map_r = np.sqrt(dx * dx + dy * dy)
    map_t = (np.arctan2(dy, dx) + np.pi) * (n_t / (2 * np.pi))
    out = cv2.remap(polar, map_r, np.minimum(map_t, n_t - 1.001), cv2.INTER_LINEAR)
    return out / (out.std() + 1e-6)


def render_tissue(rng, breast, pect, density, geo, view, cols):
    """Fat/glandular texture with fibrous strands, skin falloff and skin line; background 0."""
    rows = breast.shape[0]
    dist = cv2.distanceTransform(breast.astype(np.uint8), cv2.DIST_L2, 3)
    # glandular islands: low-pass noise through a soft threshold, sparse near the skin
    small = (max(8, rows // 4), max(8, cols // 4))  # blur at 1/4 resolution (speed)
    g = _smooth_noise(rng, small, 0.05 * small[1])
    g = cv2.resize(g, (cols, rows), interpolation=cv2.INTER_CUBIC)
    inner = np.clip(dist / (0.22 * cols), 0.0, 1.0)
    gland = 1.0 / (1.0 + np.exp(-(1.6 * g - (2.0 - 0.55 * density) + 1.2 * inner)))
    gland *= inner ** 0.5
    cy = geo["cc_cy"] if view == "CC" else geo["mlo_cy"]
    fib = _radial_strands(rng, (geo["a"], cy), (rows, cols), cols)
    fine = _smooth_noise(rng, (rows, cols), 0.8)
    fat = 0.28 + 0.03 * cv2.resize(_smooth_noise(rng, small, 0.08 * small[1]), (cols, rows))
    tissue = fat + (0.10 + 0.06 * density) * gland + (0.015 + 0.01 * gland) * fib + 0.012 * fine
    falloff = np.clip(dist / max(2.0, 0.08 * cols), 0.0, 1.0)
    tissue = tissue * (0.55 + 0.45 * falloff)  # thinner compressed tissue near the skin
    skin = (dist > 0) & (dist <= max(1.0, 0.012 * cols))
    tissue = tissue + 0.06 * skin
    if pect.any():  # pectoral muscle: bright, fairly homogeneous, brighter towards the corner
        yy, xx = np.mgrid[0:rows, 0:cols].astype(np.float32)
        t = np.clip(1.0 - (xx / geo["pect_w"] + yy / geo["pect_h"]), 0.0, 1.0)
        muscle = 0.55 + 0.12 * t + 0.02 * fine + 0.01 * fib
        pm = cv2.GaussianBlur(pect.astype(np.float32), (0, 0), max(0.6, 0.006 * cols))
        tissue = pm * muscle + (1.0 - pm) * tissue
    img = np.where(breast, tissue, 0.0).astype(np.float32)
    return img, dist


def _largest_component(mask):
    n, lab, stats, _ = cv2.connectedComponentsWithStats(mask.astype(np.uint8), connectivity=8)
    if n <= 2:
        return mask.astype(bool)
    k = 1 + int(np.argmax(stats[1:, cv2.CC_STAT_AREA]))
    return lab == k


def _mass_mask(rng, lesion, center, shape):
    """Filled polygon: smooth low-frequency contour, plus spikes for spiculated masses."""
    R, n = lesion["radius"], 96
    theta = np.linspace(0, 2 * np.pi, n, endpoint=False)
    r = np.ones(n)
    for k in range(2, 6):
        r += lesion["irregularity"] / k * np.cos(k * theta + rng.uniform(0, 2 * np.pi))
    for _ in range(lesion["spikes"]):
        j = int(rng.integers(n))
        length = rng.uniform(1.35, 1.75)
        for dj, f in ((-1, 0.55), (0, 1.0), (1, 0.55)):
            r[(j + dj) % n] = max(r[(j + dj) % n], 1.0 + (length - 1.0) * f)
    r *= R
    pts = np.stack([center[0] + r * np.cos(theta), center[1] + r * np.sin(theta)], 1)
    m = np.zeros(shape, np.uint8)
    cv2.fillPoly(m, [np.round(pts * 16).astype(np.int32)], 1, cv2.LINE_8, shift=4)
    return _largest_component(m)


def _calc_dots(rng, lesion, center, cols):
    """Tiny bright dots: malignant clusters tighter and pleomorphic (varied size/elongation)."""
    n, spread = lesion["n_dots"], lesion["radius"]
    pts = rng.normal(0, spread * lesion["tightness"], size=(n, 2))
    pts = np.clip(pts, -spread, spread) + np.asarray(center)
    base = max(0.6, 0.0045 * cols)
    sizes = base * (1 + lesion["pleomorphism"] * rng.uniform(-0.5, 1.2, n))
    return pts, np.maximum(sizes, 0.5)


def render_lesion(rng, img, lesion, center, cols):
    """Adds the lesion to ``img`` in place; returns its ROI mask (bool, one component)."""
    shape = img.shape
    if lesion["type"] == "mass":
        mask = _mass_mask(rng, lesion, center, shape)
        # denser centre than rim (distance profile), soft edge, spikes fainter than the body
        prof = cv2.distanceTransform(mask.astype(np.uint8), cv2.DIST_L2, 3)
        prof = np.clip(prof / max(1.0, 0.6 * lesion["radius"]), 0.0, 1.0)
        dens = cv2.GaussianBlur(0.35 * mask + 0.65 * prof, (0, 0), lesion["blur"])
        core = _smooth_noise(rng, shape, 0.6)
        img += dens * (lesion["contrast"] + 0.015 * core)
        return mask
    pts, sizes = _calc_dots(rng, lesion, center, cols)
    dots = np.zeros(shape, np.float32)
    for (x, y), s in zip(pts, sizes):
        ax = (int(round(s * 16)), int(round(s * 16 * (1 + lesion["pleomorphism"] * rng.uniform()))))
        cv2.ellipse(dots, (int(round(x * 16)), int(round(y * 16))), ax,
                    float(rng.uniform(0, 180)), 0, 360, 1.0, -1, cv2.LINE_AA, shift=4)
    dots = cv2.GaussianBlur(dots, (0, 0), 0.5)
    img += np.clip(dots * 1.6, 0, 1) * lesion["contrast"]
    hull = cv2.convexHull(np.round(pts).astype(np.int32))
    mask = np.zeros(shape, np.uint8)
    cv2.fillConvexPoly(mask, hull, 1)
    pad = int(np.ceil(sizes.max())) + 2
    mask = cv2.dilate(mask, cv2.getStructuringElement(cv2.MORPH_ELLIPSE, (2 * pad + 1,) * 2))
    return _largest_component(mask)


def burn_in_text(img, text, rows, cols, side):
    """Bright text label + marker square in the background on the nipple side (final frame)."""
    fs = 0.3 * cols / 96
    thick = max(1, int(round(cols / 200)))
    (tw, th), base = cv2.getTextSize(text, cv2.FONT_HERSHEY_SIMPLEX, fs, thick)
    scale = min(1.0, 0.3 * cols / max(tw, 1), 0.08 * rows / max(th + base, 1))
    fs *= scale
    (tw, th), base = cv2.getTextSize(text, cv2.FONT_HERSHEY_SIMPLEX, fs, thick)
    m = max(2, int(0.02 * cols))
    x0 = cols - m - tw if side == "L" else m  # nipple side
    canvas = np.zeros(img.shape, np.uint8)
    cv2.putText(canvas, text, (x0, m + th), cv2.FONT_HERSHEY_SIMPLEX, fs, 255, thick, cv2.LINE_AA)
    s = max(3, int(round(0.04 * cols)))
    mx = cols - m - s if side == "L" else m
    my = rows - m - s
    canvas[my:my + s, mx:mx + s] = 255
    img[:] = np.maximum(img, canvas.astype(np.float32) / 255.0 * 0.95)


def render_view(rng, geo, masks, lesions, *, view, lat, density, anatomy=None):
    """One view of one breast in its final frame: (image, ROI masks of ``lesions``, same order).

    ``masks`` = breast_masks(geo, view, ...); ``lesions`` carry their per-view centre in
    ``_xy[view]`` (plan.place_lesions). Background: faint detector noise outside the breast.
    ``anatomy`` (optional, for harder regimes): {"rng": its own generator, so the other draws
    stay those of the demo, "texture_beta", "texture_strength", "vessels", "vessel_calc_fraction",
    "summations" (plan.summation_lookalikes of this view) and their "summation_rng"};
    None leaves the image exactly as without it.
    """
    breast, pect = masks
    rows, cols = breast.shape
    img, _ = render_tissue(rng, breast, pect, density, geo, view, cols)
    if anatomy:
        arng = anatomy["rng"]
        if anatomy.get("texture_strength", 0) > 0:
            # power-law texture modulates the tissue (stronger where it is denser)
            tex = power_law_noise(arng, (rows, cols), anatomy["texture_beta"])
            img += anatomy["texture_strength"] * tex * breast * (0.5 + img)
        if anatomy.get("vessels", 0) > 0:
            n = int(arng.poisson(anatomy["vessels"]))
            render_vessels(arng, img, breast & ~pect, geo, view, n,
                           anatomy.get("vessel_calc_fraction", 0.0), cols)
        for les in anatomy.get("summations", ()):  # one-view look-alikes, not findings
            render_lesion(anatomy["summation_rng"], img, les, les["_xy"][view], cols)
    # extra findings (plan.benign_findings) draw from the anatomy's generator, as they were planned
    roi_masks = [render_lesion(anatomy["rng"] if les.get("_extra") else rng, img, les,
                               les["_xy"][view], cols) for les in lesions]
    img = np.where(breast, img, 0.0)
    bg = 0.03 + 0.012 * rng.standard_normal((rows, cols)).astype(np.float32)
    img = np.where(breast, img, np.clip(bg, 0, None))
    if lat == "R":  # chest wall on the right edge for right breasts
        img = img[:, ::-1].copy()
        roi_masks = [m[:, ::-1].copy() for m in roi_masks]
    burn_in_text(img, f"{lat} {view}", rows, cols, lat)
    return img, roi_masks
