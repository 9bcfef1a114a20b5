#!/bin/bash
sed -i 's/ehco/echo/' run.sh
